"""The broker process: client and worker sockets around the scheduling policy."""
