"""The programs that run inside an isolated command's namespaces (megarl/isolation/process_isolation.py builds the
prefix).

Each is a standalone script run as ``python -I -S <file>``: standard library only, no import of megarl, since it
runs before (ns_setup.py) or beside (ns_init.py, forwarder.py) the untrusted command.

* ns_setup.py: first, with the capabilities the namespaces grant: the read-only mounts, the hidden directories,
  the scratch tmpfs, and for an endpoint-only network the loopback interface and the forwarder; then it execs
  the rest of its argv (setpriv, which drops every capability, then ns_init.py);
* ns_init.py: the namespace's process 1: starts the command, forwards stop signals, reaps, passes the endpoint's
  connections to the forwarder;
* forwarder.py: outside the command's network namespace, without capabilities: joins each connection it is
  handed to the one address it was given (the agent endpoint), and nothing else.
"""
