"""CI's oldest-version run pins exactly the lower bounds setup.cfg declares."""

import configparser
import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent


def test_ci_oldest_pins_are_the_declared_lower_bounds():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    floors = dict(re.findall(r"^\s*([\w-]+)>=([\d.]+)", config["options"]["install_requires"], re.M))
    pins = dict(re.findall(r"([\w-]+)==([\d.]+)", re.search(r'OLDEST="(.*)"', (ROOT / ".ci/run").read_text())[1]))
    assert pins and all(floors[name] == version.removesuffix(".0") or floors[name] == version
                        for name, version in pins.items()), (pins, floors)
