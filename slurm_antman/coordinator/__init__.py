"""The cluster coordinator: the sidecar uplink (hub, keys), the daemon, and the executor of policy decisions."""
