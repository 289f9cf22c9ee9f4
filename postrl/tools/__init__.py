"""postrl.tools — see DESIGN.md."""
