"""Layer 2: what you can do with a machine: files, edits, grep, watch, commands."""
