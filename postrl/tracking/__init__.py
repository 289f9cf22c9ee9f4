"""postrl.tracking — see DESIGN.md."""
