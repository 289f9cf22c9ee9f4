"""postrl.controller — see DESIGN.md."""
