"""The reducer's internals: private modules, one concept each (nothing here is public API)."""
