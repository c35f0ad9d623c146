"""One request's shell: the pipeline that runs the machine's commands, its client response, admission."""
