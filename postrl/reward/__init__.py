"""postrl.reward — see DESIGN.md."""
