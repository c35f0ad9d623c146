"""The pdtrio backend: worker links, the instance table and placement, the embedded cluster."""
