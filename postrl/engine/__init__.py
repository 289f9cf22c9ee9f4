"""postrl.engine — see DESIGN.md."""
