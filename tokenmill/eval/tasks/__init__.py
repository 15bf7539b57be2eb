"""Eval tasks, one module each; `base.register` puts them in the registry `base.get_task` reads."""
