import socket

s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0$ABSTRACT_NAME")
s.sendall(b"hello from the sandbox")
