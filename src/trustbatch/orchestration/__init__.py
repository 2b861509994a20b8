"""Plain worker classes that run in their own processes (or, later, as Ray actors)."""
