"""Tools off the user's forward path: the report, the random-weight model builders, finding a ComfyUI outside its
own process. Nothing shipped imports this folder."""
