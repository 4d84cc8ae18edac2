"""The cuda backend for core (see plugin.py for what it registers)."""
