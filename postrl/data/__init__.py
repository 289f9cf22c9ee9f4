"""postrl.data — see DESIGN.md."""
