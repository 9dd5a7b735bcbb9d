"""The GPU differential fuzz: seeded cases over a fixed list of kernel variants, run against the fp64 reference
(``python -m tests.fuzz``; see __main__.py)."""
