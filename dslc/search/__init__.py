"""`dslc plan --mesh auto`: the search for the mesh sizes, pipeline schedule and microbatches
with the shortest estimated step time that fit. It sits above the planner (whose figures it
ranks), the elaborator and the checker (which it runs on each candidate): `auto.py` searches,
`report.py` says what it found, as text and JSON."""
