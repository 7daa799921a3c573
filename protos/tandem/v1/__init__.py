"""Generated stubs of package tandem.v1 (regenerate with `python -m protos.build`)."""
