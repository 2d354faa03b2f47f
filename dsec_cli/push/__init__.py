"""Push: stores (file, s3, oci), transfer between them, and store gc."""
