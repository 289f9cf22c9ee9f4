"""postrl.weights — see DESIGN.md."""
