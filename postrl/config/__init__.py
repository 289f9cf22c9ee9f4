"""postrl.config — see DESIGN.md."""
