"""Run `ft_launcher ARGS` or `torchrun ARGS` (argv[1] says which) with a health-check server that listens.

Open-source torch's health-check server is a stub: HealthCheckServer.start() only logs "No
health check server started", so under torchrun $TORCHELASTIC_HEALTH_CHECK_PORT opens no
port. The factory torch's agent calls (create_healthcheck_server) is where a site plugs its
own server in. This plugs in a TCP server that answers every connection with "alive <the
agent's alive time>", and appends "start PORT" / "stop PORT" to $HEALTH_SERVER_LOG, so a test
can see that a launcher starts the server torch's agent would start, on the port the variable
names, keeps it up while the workers run, and stops it at the end.
"""
import os
import socketserver
import sys
import threading

from torch.distributed.elastic.agent.server import health_check_server, local_elastic_agent


def _note(line: str) -> None:
    with open(os.environ["HEALTH_SERVER_LOG"], "a") as f:
        f.write(line + "\n")


class ListeningHealthCheckServer(health_check_server.HealthCheckServer):
    def start(self) -> None:
        alive = self._alive_callback

        class Answer(socketserver.StreamRequestHandler):
            def handle(self):
                self.wfile.write(f"alive {alive()}\n".encode())

        socketserver.TCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", self._port), Answer)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        _note(f"start {self._port}")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        _note(f"stop {self._port}")


def create(alive_callback, port, timeout):
    return ListeningHealthCheckServer(alive_callback, port, timeout)


if __name__ == "__main__":  # the fork server imports this file too, as multiprocessing's main
    local_elastic_agent.create_healthcheck_server = create
    health_check_server.create_healthcheck_server = create
    which, argv = sys.argv[1], sys.argv[2:]
    if which == "torchrun":
        from torch.distributed.run import main

        main(argv)
    else:
        from nvrx_core.ft.command import main

        sys.exit(main(argv))
