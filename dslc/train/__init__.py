"""`dslc train`: a compiled spec trained on embedded data, with metrics and checkpoints.

`loop.train` is the entry point. The package imports nothing itself, so that choosing a data
set (`data.py`, numpy only) does not start jax before the mesh has asked for its devices.
"""
