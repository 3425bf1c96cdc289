"""The operator's view: status sources (and, later, the terminal UI) over the coordinator's socket."""
