"""The on-store format: chunks, packs, layer indexes, manifests and refs (docs/format.md)."""
