"""Helpers shared by the test folders (paths to the fixtures the repository carries)."""
