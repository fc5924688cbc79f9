"""The conversion: plan (ledger, contract types), listing (dry run, type listing), run (stream,
manifest), resume, preflight (free space), progress."""
