# a 0600 file in a 0700 directory of the host's root user
with open("$SECRET_FILE") as fh:
    print(fh.read())
