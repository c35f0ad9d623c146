"""One request on the router, sans-IO: the request machine's table and the lifecycle's."""
