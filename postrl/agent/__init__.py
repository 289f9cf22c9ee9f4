"""postrl.agent — see DESIGN.md."""
