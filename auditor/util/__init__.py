"""Helpers every layer uses: rows read in blocks, checked user input, files written whole, thread counts."""
