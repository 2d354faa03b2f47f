"""The contracts every plugin of a family keeps, written once and parametrised from that
family's registry: `backends` over `dsec_cli.backends.BACKENDS`, `stores` over
`dsec_cli.core.schemes.SCHEMES`. A test module runs a suite by importing it
(``from tests.conformance.backends import *``); a backend or store scheme added to its
registry is tested with no edit here."""
