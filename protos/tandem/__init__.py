"""Package of the tandem protos (namespace only)."""
