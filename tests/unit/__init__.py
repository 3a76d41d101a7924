"""Fast tests of pure logic: no servers, no network."""
