"""ccld_plugin."""
