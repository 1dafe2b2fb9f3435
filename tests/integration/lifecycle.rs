// integration tests: written by someone else
