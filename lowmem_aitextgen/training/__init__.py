"""train() in its parts: the plan, the planner, the memory techniques, one run and what it leaves."""
