"""Worker-group backends: ``local`` (in-process) and ``ray`` (imported lazily)."""
