"""File formats and I/O: every file the tools read or write goes through a module here."""
