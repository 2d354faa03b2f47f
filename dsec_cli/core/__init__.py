"""Core: errors, configuration, digests and the small types every stage shares."""
