"""The arithmetic both backends run: plain jax functions, one per layer kind, and the pipeline.

Nothing here imports dslc: the direct backend calls these functions, and the code generator
copies their source into the standalone modules it writes, so the two backends compute with
the very same code. A kernel module may import only what a generated module imports (see
`dslc.codegen.source.PRELUDE_IMPORTS`); a test holds every kernel module to that.
"""
