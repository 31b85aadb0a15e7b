# a path socket made by the host outside /tmp (a database's socket, say)
import socket

s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("$SOCKET_PATH")
s.sendall(b"hello from the sandbox")
