"""Tools for txl's own tests (and a user's): run on a CPU what a GPU would run (``cuda_rules``)."""
