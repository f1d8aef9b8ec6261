"""arguments: a call's arguments read once from its signature; rules; unknown names with close matches
(every argument of every method, as the user meets it: test_faults_arguments.py)."""

import math

import pytest

from lowmem_aitextgen.arguments import Arguments, check, either, from_call, integer, number, optional, reject_unknown


def call(a, b=2, *, c=None, **kwargs):
    return from_call(call, locals())


def test_arguments_come_from_the_signature_with_kwargs_folded_in():
    args = call(1, c=3, extra=4)
    assert dict(args) == {"a": 1, "b": 2, "c": 3, "extra": 4}
    assert args.b == 2 and args["extra"] == 4
    assert args.extra == {"extra": 4}
    assert args.given() == {"a", "c", "extra"}  # b kept its default
    with pytest.raises(AttributeError):
        args.b = 5
    assert args.replace(b=5).b == 5 and args.b == 2


def test_given_tells_a_default_passed_again_from_a_different_value():
    assert call(1, b=2).given() == {"a"}
    assert call(1, b=2.0).given() == {"a", "b"}  # 2.0 is not the int default
    assert call(1, c=False).given() == {"a", "c"}  # False is not None


def test_an_unknown_name_is_refused_with_the_closest_known_ones():
    with pytest.raises(TypeError, match=r"f\(\) got an unknown argument lerning_rate=0.1; did you mean learning_rate"):
        reject_unknown("f()", {"lerning_rate": 0.1}, ["learning_rate", "num_steps"])
    with pytest.raises(TypeError, match="check the spelling"):
        reject_unknown("f()", {"zzz": 1}, ["learning_rate"])
    reject_unknown("f()", {"num_steps": 1}, ["num_steps"])


@pytest.mark.parametrize("rule, good, bad", [
    (integer(1, "fix"), [1, 7], [0, -1, 1.0, True, "1", None]),
    (integer(0, "fix"), [0, 3], [-1, 0.5]),
    (number(0, 1, "fix", low_open=True, high_open=True), [0.5, 1e-9], [0, 1, math.nan, math.inf, "0.5", True]),
    (number(0, math.inf, "fix"), [0, 1e9], [-1e-9, math.inf, math.nan]),
    (optional(integer(1, "fix")), [None, 2], [0]),
    (either(integer(1, ""), lambda v: None if v == "auto" else "no", says="number or 'auto'"), [3, "auto"], ["x", 0]),
], ids=["positive int", "int >= 0", "open unit interval", "finite >= 0", "optional", "either"])
def test_rules_accept_what_they_should_and_nothing_else(rule, good, bad):
    assert all(rule(value) is None for value in good)
    assert all(rule(value) for value in bad)


def test_check_names_the_argument_and_its_value():
    with pytest.raises(ValueError, match=r"^steps=0 must be a positive integer; e.g. steps=10\.$"):
        check(Arguments({"steps": 0}, {}), {"steps": integer(1, "e.g. steps=10")})
