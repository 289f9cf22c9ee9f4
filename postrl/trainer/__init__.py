"""postrl.trainer — see DESIGN.md."""
