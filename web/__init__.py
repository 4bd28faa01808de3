"""The page: plain ES modules and their vendored libraries, served by the relay."""
