"""Helpers shared by the test modules: clusters, training actors, toy training, an S3 server."""
