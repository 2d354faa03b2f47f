"""OCI images and registries, below the build: where images are read from (`sources`: a
registry, an OCI layout, a `docker save` tarball), what their documents say (`manifests`),
the streams a layer blob is read through (`streams`), dsec images written out as OCI
images (`export`), the ``oci://`` store on a registry (`store`, registered under its scheme
in `dsec_cli.push.stores`), and how an image says it runs (`runconfig`: its user and
command). `dsec import` turns images into dsec layers with the layer writer
(`dsec_cli.build.ociimport`)."""
