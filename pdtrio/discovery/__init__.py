"""Finding instances: the registry interface, static and etcd."""
