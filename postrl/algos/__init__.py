"""postrl.algos — see DESIGN.md."""
