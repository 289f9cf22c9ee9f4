"""postrl.rollout — see DESIGN.md."""
