"""Object-store backends (s3://, gs://); filled in by the object-storage work."""
