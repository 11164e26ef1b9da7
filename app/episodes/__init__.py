"""Front doors that hold an episode (OpenEnv, ORS) over the one tool-call service, and their shared parts:
the Task API (`tasks`), the session records (`sessions`) and a step or a submit (`episode`)."""
